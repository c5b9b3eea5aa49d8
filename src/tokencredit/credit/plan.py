"""The plan: what a trainer must run for a credit spec, derived from the methods' declarations.

Every method declares, in its own file (``registry``): the CreditBatch fields it reads
(``requires``), an oracle pass (``oracle``), a critic (``critic``), whether it needs a LoRA
adapter (``needs_adapter``) and the loss aggregation of its paper (``loss_defaults``). This
module turns a :class:`~tokencredit.credit.spec.CreditPipeline` into the minimal set of forward passes,
each computed once and shared by every signal it serves:

    pass          model                               gives
    policy        the policy, no grad                 logprobs, entropy, mode_prob, sum_pi_squared,
                                                        hidden states
    adapter_off   the policy with its adapter off      ref_logprobs (LoRA reference), hidden (ARCA)
    reference     a separate frozen reference model    ref_logprobs
    oracle        the policy or a teacher, on the      oracle_logprobs
                  oracle prompt or the student's own
    critic        a value head on the policy's hidden  values
    enumeration   the policy on every continuation     true_values (exact V(h_t); a task with a
                  of a response-space task             response space: exactvalue)
    continuations the policy samples K continuations   mc_values, step_starts (the declared
                  after each step's prefix, scored     ContinuationPass: its cut rule, K; the own
                  by the task's reward                 trainer: continuations)
    saliency      the policy, one forward and one      outcome_saliency (the declared SaliencyPass:
                  backward to its input embeddings     OAR-G; the own trainer: saliency)
    (none)        the rollout's own sampled tokens     token_ids

A trainer knows passes, never method names: ``tests/test_external_method.py`` registers methods
from outside the package and runs them through both trainers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple

from ..errors import PlanError  # noqa: F401 (defined in errors; importable here too)
from .registry import ContinuationPass, CriticSpec, OraclePass, SaliencyPass, default_oracle
from .spec import CreditPipeline

__all__ = ["SignalPlan", "PlanError", "plan_signals"]

#: the signals of the policy's own no-grad pass
POLICY_SIGNALS = ("logprobs", "entropy", "mode_prob", "sum_pi_squared")
#: signals no trainer computes yet (a spec reading one is refused before any model loads);
#: inspect and fidelity derive them from a rollouts file
#: signals computed from the rollout's tokens alone, without a model pass (passes.run_passes)
TOKEN_ONLY_SIGNALS = frozenset({"token_ids", "planning_mask"})
UNCOMPUTED_SIGNALS: Dict[str, str] = {}  # signals no trainer computes, with what they are (none at present)


@dataclass(frozen=True)
class SignalPlan:
    """The passes one step needs. ``signals`` are the CreditBatch fields to fill."""

    signals: FrozenSet[str]
    policy: Tuple[str, ...]  # signals of the policy pass (POLICY_SIGNALS)
    policy_hidden: bool  # the policy pass keeps its final hidden states (critic, ARCA)
    adapter_off: Tuple[str, ...]  # ("logprobs", "hidden") subset: the adapter-off pass's outputs
    reference: bool  # a separate reference model scores the batch
    oracle: Optional[OraclePass]
    critic: Optional[CriticSpec]
    true_values: bool = False  # the enumeration pass: the policy's exact V(h_t) (exactvalue)
    continuations: Optional[ContinuationPass] = None  # Monte Carlo continuations per step (mc_values)
    saliency: Optional[SaliencyPass] = None  # the input-gradient pass (outcome_saliency; OAR-G)

    @property
    def passes(self) -> Tuple[str, ...]:
        """The passes in the order a trainer runs them (for logs and tests)."""
        out = []
        if self.policy or self.policy_hidden:
            out.append("policy")
        if self.adapter_off:
            out.append("adapter_off")
        if self.reference:
            out.append("reference")
        if self.oracle is not None:
            out.append("oracle")
        if self.critic is not None:
            out.append("critic")
        if self.true_values:
            out.append("enumeration")
        if self.continuations is not None:
            out.append("continuations")
        if self.saliency is not None:
            out.append("saliency")
        return tuple(out)

    def with_signals(self, extra) -> "SignalPlan":
        """The same plan computing more signals (a saved eval batch carries every signal the
        trainer can give); the extra oracle pass uses the estimator's declaration when it has
        one, else :func:`~tokencredit.credit.registry.default_oracle` (the self-oracle the registered
        oracle methods declare at their defaults)."""
        return _build(self.signals | frozenset(extra), self.oracle, self.critic, lora=self._lora,
                      explicit_reference=self._explicit_reference, continuations=self.continuations,
                      saliency=self.saliency)

    @classmethod
    def policy_only(cls, *, hidden: bool) -> "SignalPlan":
        """One policy pass giving log-probs (and its hidden states): e.g. the updated actor's
        pass that a critic declared ``after_actor`` trains on."""
        return cls(signals=frozenset({"logprobs"}), policy=("logprobs",), policy_hidden=hidden, adapter_off=(),
                   reference=False, oracle=None, critic=None)

    # filled in by plan_signals (not part of the public plan)
    _lora: bool = False
    _explicit_reference: bool = False


def _build(signals, oracle, critic, *, lora: bool, explicit_reference: bool,
           continuations: Optional[ContinuationPass] = None, saliency: Optional[SaliencyPass] = None) -> SignalPlan:
    signals = frozenset(signals)
    policy = tuple(s for s in POLICY_SIGNALS if s in signals)
    needs_ref = "ref_logprobs" in signals
    # the LoRA reference is the adapter-off pass (the initial policy) unless a reference model
    # is named; without an adapter a frozen copy (or the named model) is the reference
    ref_from_adapter = needs_ref and lora and not explicit_reference
    adapter_off = tuple(
        x for x, on in (("logprobs", ref_from_adapter), ("hidden", "hidden_residual" in signals)) if on
    )
    if "oracle_logprobs" in signals and oracle is None:
        oracle = default_oracle()  # what the registered oracle methods declare at their defaults
        if oracle is None:
            raise PlanError("oracle_logprobs: expected a registered method that declares a policy-scored oracle pass, got none")
    return SignalPlan(
        signals=signals,
        # the policy pass always gives log-probs (the loss's old log-probs come from it); signals
        # read off the rollout's tokens (token_ids, planning_mask) need no pass
        policy=(("logprobs",) + tuple(p for p in policy if p != "logprobs")) if signals - TOKEN_ONLY_SIGNALS else (),
        policy_hidden="values" in signals or "hidden_residual" in signals,
        adapter_off=adapter_off,
        reference=needs_ref and not ref_from_adapter,
        oracle=oracle if "oracle_logprobs" in signals else None,
        critic=critic if "values" in signals else None,
        true_values="true_values" in signals,
        continuations=continuations if {"mc_values", "step_starts"} & signals else None,
        saliency=saliency if "outcome_saliency" in signals else None,
        _lora=lora,
        _explicit_reference=explicit_reference,
    )


def plan_signals(
    credit: CreditPipeline,
    *,
    lora: bool,
    kl: bool = False,
    explicit_reference: bool = False,
    teacher: bool = False,
    enumerable: bool = False,
    continuations: bool = False,
    saliency: bool = False,
) -> SignalPlan:
    """The passes a step of ``credit`` needs under this setting.

    lora: the policy carries a LoRA adapter. kl: the loss has a KL term (needs ref_logprobs).
    explicit_reference: a reference model was named or given (it wins over the adapter-off pass).
    teacher: a teacher model was given. enumerable: the task declares a response space whose
    continuations the trainer can enumerate (the ``true_values`` signal). continuations: the
    trainer can sample continuations of a response prefix from the policy and score them with
    the task's reward (the ``mc_values`` signal; the own trainer). saliency: the trainer can run a
    backward pass of the policy to its input embeddings (the ``outcome_saliency`` signal; the own
    trainer). Raises :class:`PlanError` when a declared need cannot be
    met (an adapter-reading method without LoRA, a teacher-scored pass without a teacher).
    """
    signals = set(credit.required_signals)
    for name, what in UNCOMPUTED_SIGNALS.items():
        if name in signals:
            who = [m.name for m in credit.methods if name in m.requires]
            raise PlanError(
                f"credit '{credit.name}': {', '.join(who)} reads {name} ({what}), which the trainers do not compute yet; "
                f"expected a spec without it (replay it on saved rollouts: tokencredit inspect / fidelity), got {credit.name!r}"
            )
    if "true_values" in signals and not enumerable:
        who = [m.name for m in credit.methods if "true_values" in m.requires]
        raise PlanError(
            f"credit '{credit.name}': {', '.join(who)} reads true_values (the policy's exact V by enumeration); expected "
            f"a task with a response space (tokencredit bench's tasks: keytok, carry, fork) and the own trainer, got none"
        )
    if {"mc_values", "step_starts"} & signals and not continuations:
        who = [m.name for m in credit.methods if {"mc_values", "step_starts"} & set(m.requires)]
        raise PlanError(
            f"credit '{credit.name}': {', '.join(who)} reads mc_values (Monte Carlo values from continuations sampled "
            f"after each step and scored by the task's reward); expected the own trainer with the task's reward "
            f"(no reward.funcs), got a trainer that cannot sample and score continuations"
        )
    if "outcome_saliency" in signals and not saliency:
        who = [m.name for m in credit.methods if "outcome_saliency" in m.requires]
        raise PlanError(
            f"credit '{credit.name}': {', '.join(who)} reads outcome_saliency (OAR-G: a backward pass of the policy to "
            f"its input embeddings per step); expected the own trainer (tokencredit train), got a trainer that does not run it"
        )
    if kl:
        signals.add("ref_logprobs")
    oracle = critic = cont = sal = None
    for m in credit.methods:
        cfg = credit.configs[m.name]
        if m.needs_adapter and not lora:
            raise PlanError(
                f"credit '{credit.name}': {m.name} reads the LoRA adapter's effect; expected a model with a LoRA "
                f"adapter (--model.lora), got one without"
            )
        if m.oracle is not None and "oracle_logprobs" in m.requires:
            o = m.oracle(cfg)
            if o is not None:
                if oracle is not None and o != oracle:
                    raise PlanError(f"credit '{credit.name}': two methods declare different oracle passes")
                oracle = o
        if m.critic is not None and "values" in m.requires:
            critic = m.critic(cfg)
        if m.continuations is not None and {"mc_values", "step_starts"} & set(m.requires):
            c = m.continuations(cfg)
            if cont is not None and c != cont:
                raise PlanError(f"credit '{credit.name}': two methods declare different continuation passes")
            cont = c
        if m.saliency is not None and "outcome_saliency" in m.requires:
            sp = m.saliency(cfg)
            if sal is not None and sp != sal:
                raise PlanError(f"credit '{credit.name}': two methods declare different saliency passes")
            sal = sp
    if oracle is not None and oracle.scorer == "teacher" and not teacher:
        raise PlanError(
            f"model.teacher: credit '{credit.name}' has {credit.estimator.name}.oracle='teacher'; expected a teacher "
            f"model (--model.teacher NAME), got none"
        )
    if teacher and (oracle is None or oracle.scorer != "teacher"):
        said = f"{credit.estimator.name}.oracle='self' (the policy scores the oracle prompt)" if oracle is not None else "no teacher-scored pass"
        raise PlanError(
            f"model.teacher: credit '{credit.name}' has {said}, so the teacher would be unused; expected no teacher"
            + (f" or --credit-args {credit.estimator.name}.oracle=teacher" if oracle is not None else "") + ", got a teacher"
        )
    return _build(signals, oracle, critic, lora=lora, explicit_reference=explicit_reference, continuations=cont,
                  saliency=sal)
