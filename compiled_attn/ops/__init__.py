"""torch.library ops under the `compiled_attn` namespace, each with its fake kernel beside it."""

from compiled_attn.ops import cache  # noqa: F401
