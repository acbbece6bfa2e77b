"""A run's config checked before anything is built or written, every error naming the key at
fault; the recipes, ``squash validate``, the merge and the model assembly call these.

- :mod:`~squash.config.keys`: :class:`~squash.config.keys.ConfigKeyError`, unknown keys named
  with the nearest valid one, ``_component_`` blocks checked against what they name, integer
  values;
- :mod:`~squash.config.values`: the values every recipe reads (types and ranges, the
  ``model`` block's adapter values, the files the config names);
- :mod:`~squash.config.blocks`: squash's own blocks (``mask_update``, ``heldout``) and the
  ``model`` block as its builder takes it;
- :mod:`~squash.config.validate`: a whole config as ``squash validate`` checks it;
- :mod:`~squash.config.overrides`: command-line overrides that are not valid YAML, named in
  one line with the form that works.

Below :mod:`squash.training`, :mod:`squash.runs` and :mod:`squash.assembly`, which read the
config; above :mod:`squash.nf4` (``model.base_outliers`` is parsed there).
"""
