"""Vision towers (CLIP, SigLIP), loadable alone and shared by the vision-language wrappers."""
