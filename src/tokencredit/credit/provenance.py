"""Where a formula comes from; shared by the credit registry and the loss registry (neither
imports the other)."""

#: ``ref-code``: read in the authors' code; ``paper``: from the paper's text; ``reconstructed``:
#: derived from the paper's claims (docs/methods.md says which claim each piece serves)
PROVENANCE = ("ref-code", "paper", "reconstructed")
