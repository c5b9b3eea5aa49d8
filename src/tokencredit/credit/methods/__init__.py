"""Built-in credit methods, one file each. Importing this package registers them all."""

from importlib import import_module

# estimators
_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "gae", "pact", "gtpo", "opd", "oppo", "ktae", "otb", "oracle", "vineppo", "spo"]
# calibrators
_CALIBRATORS = ["taco", "stare", "acpo", "arca", "intrinsic", "hicra", "sepa", "forking", "oar"]

for _name in _ESTIMATORS + _CALIBRATORS:
    import_module(f"{__name__}.{_name}")
