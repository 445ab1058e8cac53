"""Model layer: routed linears, attach to transformers models, base loading, the lean runner."""
