"""Load-test tools for prefix-router: the demo, simulated vLLM replicas, workloads, reports."""

import os

# transformers announces at import that PyTorch is absent; tokenizers are all we use. Set
# before anything here imports it (every loadtest entry point imports this package first).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
