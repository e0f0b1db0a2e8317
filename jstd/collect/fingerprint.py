"""A fingerprint of what a Python function computes, for ``jstd.collect``'s resume key: its code (bytecode, the
names it uses and its constants, nested functions' code included), its defaults, the values its closure captured
and the values of the globals it reads. Two functions with the same fingerprint compute the same thing on the
same inputs; a function that captures a value with no stable fingerprint (an open file, an object whose ``repr``
is its address) is refused, with the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import types

import numpy as np

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Unhashable(ValueError):
    """A value whose fingerprint is not defined (``value_bytes``)."""


def function_key(fn, what: str) -> str:
    """A hex digest of what ``fn`` computes (see the module docstring). ValueError naming ``what`` (the setting:
    ``"positions"``, ``"the Apply edit at layers.1.mlp.mlp_output"``) and the fix when ``fn`` captures a value
    without a stable fingerprint."""
    h = hashlib.sha256()
    try:
        _feed(h, fn, set())
    except Unhashable as e:
        raise ValueError(f"jstd.collect: {what} is a function whose value cannot be fingerprinted for resuming "
                         f"({e}); capture only numbers, strings, arrays, tuples, dicts, functions or equinox "
                         "modules in it (functools.partial(f, factor=0.5) or a closure over a float), or pass an "
                         "eqx.Module") from None
    return h.hexdigest()[:32]


def _feed(h, value, seen: set) -> None:
    """``value``'s fingerprint fed into ``h``; ``seen``: the ids of the functions on the way (recursion)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (np.ndarray, np.generic)) or _is_array(value):
        a = np.asarray(value)
        h.update(f"array {a.dtype} {a.shape};".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    elif isinstance(value, (tuple, list, frozenset, set)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        h.update(f"{type(value).__name__}({len(items)});".encode())
        for v in items:
            _feed(h, v, seen)
    elif isinstance(value, dict):
        h.update(f"dict({len(value)});".encode())
        for k in sorted(value, key=repr):
            _feed(h, k, seen)
            _feed(h, value[k], seen)
    elif isinstance(value, types.ModuleType):
        h.update(f"module {value.__name__};".encode())
    elif isinstance(value, type):
        h.update(f"type {value.__module__}.{value.__qualname__};".encode())
    elif isinstance(value, functools.partial) or type(value).__name__ == "Partial" and hasattr(value, "func"):
        h.update(b"partial;")
        _feed(h, value.func, seen)
        _feed(h, tuple(value.args), seen)
        _feed(h, dict(value.keywords or {}), seen)
    elif isinstance(value, types.MethodType):
        h.update(b"method;")
        _feed(h, value.__func__, seen)
        _feed(h, value.__self__, seen)
    elif isinstance(value, types.FunctionType):
        _feed_function(h, value, seen)
    elif isinstance(value, types.CodeType):
        _feed_code(h, value, seen)
    elif isinstance(value, (types.BuiltinFunctionType, np.ufunc)):
        h.update(f"builtin {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value.__name__)};"
                 .encode())
    elif dataclasses.is_dataclass(value):  # equinox modules are dataclasses: their class and every field
        h.update(f"dataclass {type(value).__module__}.{type(value).__qualname__};".encode())
        for f in dataclasses.fields(value):
            h.update(f"{f.name}=".encode())
            _feed(h, getattr(value, f.name, None), seen)
        if hasattr(type(value), "__call__"):
            _feed(h, getattr(type(value).__call__, "__code__", None), seen)
    elif callable(value) and hasattr(value, "__qualname__"):  # a jitted or wrapped function: its name and code
        h.update(f"callable {getattr(value, '__module__', '')}.{value.__qualname__};".encode())
        wrapped = getattr(value, "__wrapped__", None)
        if wrapped is not None:
            _feed(h, wrapped, seen)
    else:
        text = repr(value)
        if _ADDRESS.search(text) or text.startswith("<"):
            raise Unhashable(f"it holds a {type(value).__name__} ({text[:60]})")
        h.update(f"{type(value).__qualname__}:{text};".encode())


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "__array__")


def _feed_function(h, fn: types.FunctionType, seen: set) -> None:
    h.update(f"function {fn.__module__}.{fn.__qualname__};".encode())
    if id(fn) in seen:  # a recursive function: its code is on the way already
        return
    seen.add(id(fn))
    _feed_code(h, fn.__code__, seen)
    _feed(h, fn.__defaults__, seen)
    _feed(h, fn.__kwdefaults__, seen)
    cells = fn.__closure__ or ()
    for name, cell in zip(fn.__code__.co_freevars, cells):
        h.update(f"free {name}=".encode())
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later)
            contents = None
        _feed(h, contents, seen)
    for name in sorted(_global_names(fn.__code__)):  # the globals it reads, by value
        if name in fn.__globals__:
            value = fn.__globals__[name]
            h.update(f"global {name}=".encode())
            if callable(value) and getattr(value, "__module__", None) != fn.__module__:
                # a library's function or class (jnp.where): by its name, not its library's code
                h.update(f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', name)};".encode())
            else:
                _feed(h, value, seen)


def _feed_code(h, code: types.CodeType, seen: set) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for c in code.co_consts:
        _feed(h, c, seen) if isinstance(c, types.CodeType) else h.update(f"{type(c).__name__}:{c!r};".encode())


def _global_names(code: types.CodeType) -> set[str]:
    """The names ``code`` (and the code nested in it) may read as globals."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names
