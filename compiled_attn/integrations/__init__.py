"""Integrations with model libraries; each is an optional extra (`pip install compiled_attn[transformers]`)."""
