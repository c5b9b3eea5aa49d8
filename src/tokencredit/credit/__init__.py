"""The credit layer: what a method is and computes, with no model and no trainer.

The validated `CreditBatch` (batch), shared masked math (ops), provenance tags, the registry of
methods and their declarations, `CreditPipeline` and the credit step every trainer shares (spec),
the signal plan a spec needs (plan), planning tokens (planning), the methods (methods/, one file
each), the policy losses and their aggregation (losses/), and the metrics of any method's output
(diagnostics). It imports nothing of tokencredit above `errors`.
"""
