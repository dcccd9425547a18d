"""The DMLP: block features, the flax reuse predictor, and the policy that turns predictions into cache actions."""
