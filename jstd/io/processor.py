"""``jstd.load_processor``: a checkpoint's HuggingFace tokenizer or processor, built by transformers (imported only
when called), padding on the left."""

from __future__ import annotations

import json

from jstd.io.hub import resolve


def load_processor(path_or_repo_id):
    """The checkpoint's HuggingFace processor, tokenizer or (for a vision tower) image processor, the PIL
    backend where there is a choice (use ``return_tensors="np"``; ``jstd.Inputs.of`` converts the output).

    Tokenizers pad on the LEFT (``padding_side="left"``; a processor's tokenizer too): every family jstd loads is
    a causal LM, whose padded batch then ends each row at its last real token.

    Raises FileNotFoundError when the folder has no tokenizer vocabulary and no image processor (naming the files
    looked for), ValueError when the files are there but transformers cannot build any of them (with its reasons).
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    folder = resolve(path_or_repo_id)
    vocabulary = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tekken.json")
    image = ("preprocessor_config.json", "processor_config.json")
    has = lambda names: [n for n in names if (folder / n).exists()]
    reasons = []
    if has(vocabulary + image + ("tokenizer_config.json",)):
        builders = {"AutoProcessor": AutoProcessor.from_pretrained, "the processor without videos": _without_videos,
                    "AutoTokenizer": AutoTokenizer.from_pretrained,
                    "AutoImageProcessor": AutoImageProcessor.from_pretrained}
        for name, build in builders.items():
            try:
                processor = build(folder)
            except Exception as e:
                reasons.append(f"{name}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
                continue
            if processor is not None:
                tokenizer = getattr(processor, "tokenizer", processor)
                if hasattr(tokenizer, "padding_side"):
                    tokenizer.padding_side = "left"
                return processor
    missing = []
    if not has(vocabulary):
        missing.append(f"no tokenizer vocabulary ({', '.join(vocabulary[:4])} or vocab.txt)")
    if not has(("tokenizer_config.json",)):
        missing.append("no tokenizer_config.json")
    if not has(image):
        missing.append("no preprocessor_config.json (an image processor's)")
    message = (f"jstd.load_processor: {folder} has {'; '.join(missing) or 'the files'}"
               + ("; transformers could not build a tokenizer or processor from it: " + " | ".join(reasons)
                  if reasons else "")
               + ". Copy the tokenizer (and processor) files from the model's original repo (the base model's, "
                 "for a fine-tune), or pass the folder or repo id that has them")
    raise (FileNotFoundError if not has(vocabulary) and not has(image) else ValueError)(message)


def _without_videos(folder):
    """The checkpoint's image-text processor built without its video processor (Qwen2-VL's needs torchvision, which
    jstd does not use), or None when the folder names no such processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    name = None
    for config in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = folder / config
        if path.exists():
            name = name or json.loads(path.read_text()).get("processor_class")
    cls = getattr(transformers, name or "", None)
    if cls is None or "video_processor" not in getattr(cls, "get_attributes", lambda: ())():
        return None

    class WithoutVideos(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    WithoutVideos.__name__ = cls.__name__
    try:
        return WithoutVideos(image_processor=AutoImageProcessor.from_pretrained(folder),
                             tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None)
    except Exception:
        return None
