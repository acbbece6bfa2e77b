"""squash: Sparse, Quantized fine-tuning using Adapters at home.

Importing squash registers the ``torch.ops.squash`` custom ops (native kernels compile on first
use) and the OmegaConf resolver ``${squash_asset:NAME}`` that configs name shipped files with, and
filters two third-party messages squash cannot act on (:mod:`squash._quiet`).
"""

from squash._quiet import quiet_third_party

quiet_third_party()  # before torch or torchao are imported, where squash is imported first

from squash import ops  # noqa: F401  (registers torch.ops.squash.ffi_*)
from squash import nf4  # noqa: F401  (registers torch.ops.squash.nf4_*)
from squash import sparsity  # noqa: F401  (the FFI format, as squash.sparsity; registers nothing)
from squash.assets import register_resolvers

register_resolvers()

__version__ = "0.3.6"
