"""Script glue, in one home: what the scripts share, above the trainers and beside the modalities.

    text.py      text data fields, loading and checking rows and rewards before any model loads, token limits
    image.py     the online image scripts' config, the hub route from a config to a denoiser, prompts, the run
    vision.py    image rows for vision-language scripts (read and checked up front), the VLM-or-LM policy choice
    presets.py   the hub presets of the image scripts and the prompt files shipped with them
    outputs.py   the end of a run: ``final/``, ``summary.json``, the comparison picture, the load lines

The modalities (``unialign.text``, ``unialign.image``, ``unialign.vision``) never import a trainer; the trainers
never import a modality; a recipe may import both (``tests/test_import_boundaries.py``).
"""
