"""tokencredit: token-level credit assignment for RL of language models.

Three lines::

    from tokencredit import CreditBatch, CreditPipeline
    credit = CreditPipeline("grpo+taco")            # any estimator + calibrators, by name
    out = credit(CreditBatch(response_mask=m, rewards=r, group_ids=g, logprobs=lp, entropy=h))
"""

from .credit.batch import SIGNALS, TOKEN_SIGNALS, CreditBatch, CreditInputError
from .credit.registry import (
    CreditOutput,
    MethodInfo,
    get_method,
    list_methods,
    register_calibrator,
    register_estimator,
)
from .credit.spec import CreditPipeline, compute_credit, parse_spec

__version__ = "0.1.0"

__all__ = [
    "CreditBatch",
    "CreditInputError",
    "CreditOutput",
    "CreditPipeline",
    "MethodInfo",
    "SIGNALS",
    "TOKEN_SIGNALS",
    "compute_credit",
    "get_method",
    "list_methods",
    "parse_spec",
    "register_calibrator",
    "register_estimator",
]
