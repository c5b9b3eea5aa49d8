"""Controlled tasks where token credit should matter and the true credit is computable.

Each task's responses are exactly ``length`` tokens over a two- or three-letter alphabet
(:class:`~tokencredit.engine.exactvalue.ResponseSpace`), so the value V(h) of every prefix under a policy
that samples only that alphabet is an exact sum over at most A^length continuations. Rewards are
0 or 1. The question spaces are small, so the eval split is the whole space (at most ``n_eval``
of it, a fixed draw) and the train split the whole space in a seeded order: the benchmark
measures how fast a method learns the task, not how it generalises to held-out questions.

keytok   "key aba" -> 8 letters over {a, b}; reward 1 iff letters 2, 5 and 7 are the key's three
         letters. Key tokens: 3 of 8 positions decide the reward, the other 5 are free. Uniform
         credit gives the 5 free tokens the sequence's advantage too, a random-sign push that is
         pure noise (and spends the clip range and the gradient norm); the true credit of a free
         token is 0. 8 questions.
carry    "10+11" (2-bit binary numbers) -> the written-out addition, least significant bit
         first: s0 c1 s1 c2 (sum bit, carry bit, per column); reward 1 iff all four are right.
         Multi-step with intermediate results: one wrong bit decides the outcome (the value
         drops to 0 there), yet uniform credit blames every correct step of a failed response
         as much as the wrong one. 16 questions.
fork     "fork ca" -> 6 letters over {a, b, c}; reward 1 iff the first letter is the prompt's first
         letter (``c.....``). A forking token: the first letter is a three-way choice that decides
         the outcome (a wrong fork makes success unreachable, the right one makes it certain); the
         5 letters after it are free and keep the near-uniform policy's high entropy (log 3 each).
         Uniform credit gives those 5 tokens the fork's outcome too: a random-sign push on 5 of 6
         tokens, noise on exactly the parameters (the same attention to the prompt) that must
         learn to read the fork's letter; the true credit of a token after the fork is 0, and the
         fork's own true credit V(h_1) - V(h_0) is exact, not the noisy R - mean. No policy that
         ignores the prompt beats chance (1/3), so nothing but reading the prompt at the fork
         raises the success. 9 questions (the prompt's two letters over {a, b, c}; the second is
         a distractor). (The first fork, 8 letters copying the prompt's majority letter after an
         80-step warm start, did not separate oracle credit from GRPO: its continuation had low
         entropy, which costs uniform credit nothing, and a one-letter policy was a shortcut to
         1/2; see docs/benchmark.md.)

The policies ``tokencredit bench`` trains on them (:mod:`tokencredit.analysis.bench_policy`) start from a
seed, near uniform over the alphabet, so that on each task the initial success rate is between 5%
and 50% (keytok ~1/8, carry ~1/16, fork ~1/3); a task may warm-start it on noisy demonstrations
(:func:`demonstration`, ``bench_policy.WARM_STEPS``), none does at present.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from .datasource import Example
from ..engine.exactvalue import ResponseSpace

__all__ = ["CONTROLLED", "ControlledTask", "build", "demonstration", "solution", "fork_reward"]

EVAL_SEED = 1234


@dataclass(frozen=True)
class ControlledTask:
    name: str
    space: ResponseSpace
    description: str
    questions: Callable[[], List[Tuple[str, str]]]  # (question, answer = the one correct response)
    # warm start: (probability a demonstration token at a decisive position is right, at a free
    # or continuation position is the rule's); see demonstration()
    warm: Tuple[float, float]


def _keytok_questions() -> List[Tuple[str, str]]:
    out = []
    for i in range(8):
        key = "".join("ab"[(i >> s) & 1] for s in (2, 1, 0))
        resp = ["a"] * 8
        for pos, ch in zip(KEY_POSITIONS, key):
            resp[pos] = ch
        out.append((f"key {key}", "".join(resp)))
    return out


#: keytok's decisive positions (0-based): letters 2, 5 and 7
KEY_POSITIONS = (1, 4, 6)


def _carry_questions() -> List[Tuple[str, str]]:
    out = []
    for a in range(4):
        for b in range(4):
            out.append((f"{a:02b}+{b:02b}", _carry_trace(a, b)))
    return out


def _carry_trace(a: int, b: int) -> str:
    c, s = 0, []
    for i in range(2):
        x, y = (a >> i) & 1, (b >> i) & 1
        s += [str(x ^ y ^ c)]
        c = (x + y + c) >> 1
        s += [str(c)]
    return "".join(s)


def _fork_questions() -> List[Tuple[str, str]]:
    out = []
    for x in FORK_ALPHABET:
        for y in FORK_ALPHABET:
            out.append((f"fork {x}{y}", x * FORK_LENGTH))  # one correct response: the fork, then any letters
    return out


FORK_ALPHABET = "abc"
FORK_LENGTH = 6


CONTROLLED: Dict[str, ControlledTask] = {
    t.name: t
    for t in (
        ControlledTask("keytok", ResponseSpace("ab", 8), "key tokens: 3 of 8 letters decide the reward, 5 are free (8 questions)",
                       _keytok_questions, warm=(0.5, 0.5)),
        ControlledTask("carry", ResponseSpace("01", 4), "2-bit binary addition written out bit by bit with its carries; "
                       "every step must be right (16 questions)", _carry_questions, warm=(0.75, 0.75)),
        ControlledTask("fork", ResponseSpace(FORK_ALPHABET, FORK_LENGTH), "forking token: the first of 6 letters over "
                       "{a, b, c} (the prompt's first letter) decides the outcome, the 5 after it are free (9 questions)",
                       _fork_questions, warm=(1 / 3, 1 / 3)),
    )
}


def solution(example: Example) -> str:
    """The one correct response of a controlled task's example."""
    return str(example.answer)


def exact_reward(completion: str, example: Example) -> float:
    """1.0 iff the response is the correct one (surrounding whitespace ignored), else 0.0."""
    return 1.0 if completion.strip() == str(example.answer) else 0.0


def keytok_reward(completion: str, example: Example) -> float:
    """1.0 iff the key positions hold the key's letters (the free positions are not read)."""
    c, want = completion.strip(), str(example.answer)
    return 1.0 if len(c) == len(want) and all(c[p] == want[p] for p in KEY_POSITIONS) else 0.0


def fork_reward(completion: str, example: Example) -> float:
    """1.0 iff the response has the task's length and its first letter (the fork) is the answer's
    (the letters after it are not read)."""
    c, want = completion.strip(), str(example.answer)
    return 1.0 if len(c) == len(want) and c[:1] == want[:1] else 0.0


REWARDS: Dict[str, Callable[[str, Example], float]] = {"keytok": keytok_reward, "carry": exact_reward, "fork": fork_reward}


def _example(name: str, question: str, answer: str) -> Example:
    digest = hashlib.sha1(question.encode("utf-8")).hexdigest()[:12]
    return Example(id=f"{name}-{digest}", question=question, answer=answer, messages=({"role": "user", "content": question},))


def build(name: str, seed: int, n_train: int, n_eval: int) -> Tuple[List[Example], List[Example]]:
    """``(train, eval)``: eval a fixed draw of at most ``n_eval`` questions (the whole space when
    it fits), train the whole space (at most ``n_train`` of it) in the order of ``seed``; the
    trainer goes through it again, in a new order, every epoch."""
    space = [_example(name, q, a) for q, a in CONTROLLED[name].questions()]
    ev = list(space)
    random.Random(f"{name}-eval-{EVAL_SEED}").shuffle(ev)
    tr = list(space)
    random.Random(f"{name}-train-{seed}").shuffle(tr)
    return tr[:n_train], ev[:n_eval]


def demonstration(name: str, example: Example, rng: random.Random) -> str:
    """A noisy demonstration for the warm start: the correct response with each token kept with
    the task's warm probabilities (``ControlledTask.warm``), else flipped to the other letter.
    keytok and fork: letters uniform at random (the policy starts from the near-uniform one);
    carry: every bit right with probability warm[0]."""
    t = CONTROLLED[name]
    a = t.space.alphabet
    want = str(example.answer)
    if name in ("keytok", "fork"):
        return "".join(rng.choice(a) for _ in want)
    flip = {a[0]: a[1], a[1]: a[0]}
    return "".join(ch if rng.random() < t.warm[0] else flip[ch] for ch in want)
