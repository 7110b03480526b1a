"""The router lab, beside the eval harness it reads runs from: labels from runs (labels.py),
the reference-likelihood proxy that labels without generating (proxy.py), each model's
context-budget curve (contexts.py), the router scored on held-out labels (heldout.py), and
training it (train.py: `sluice train-router`). docs/router-history.md tells how it got here."""
