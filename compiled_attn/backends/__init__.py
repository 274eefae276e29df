"""The backends this version ships, registered in auto-selection order (fastest first).

Each module holds one backend: capabilities, Metadata, Builder, State, Impl (docs/design.md,
"Adding a backend"). Importing this package (which `import compiled_attn` does) registers them.
"""

from compiled_attn.backends.flashinfer import FlashInferBackend
from compiled_attn.backends.torch_sdpa import TorchSDPABackend
from compiled_attn.backends.xformers import XFormersBackend
from compiled_attn.registry import register_backend

SHIPPED = (FlashInferBackend, XFormersBackend, TorchSDPABackend)
for _backend in SHIPPED:
    register_backend(_backend)
