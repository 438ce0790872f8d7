"""Builders of the demo worlds' shipped assets, for a source checkout (not installed: ``pyproject.toml``
packages ``unialign*`` only). Run from the repository root:

    python -m tools.build_arith_lm check          # rebuild the arithmetic LM in a temp folder, compare (sha256)
    python -m tools.build_shapes_world check --stage data   # the same for a stage of the image world

``unialign.embedded`` holds what a run needs (data, rewards, loaders); these modules hold what made its
``assets/`` (training recipes, the ``BUILD.md`` writer) and what checks a rebuild against them
(``tools.asset_check``).
"""
