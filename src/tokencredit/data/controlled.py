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
carry    "10+11" (2-bit binary numbers) -> the addition written out column by column, least
         significant first: per column its carry in, its two digits and its sum bit
         (c_i x_i y_i s_i), then the final carry c2 ("11+01" -> 0110 1100 1); reward 1 iff the
         answer bits s0, s1, c2 (letters 4, 8, 9: the sum a + b) are right. The work (the carries
         in, the copied digits) is written out but not graded, as a math reward reads the answer
         and not the working. Multi-step arithmetic where one step's error decides the outcome: a
         wrong answer bit makes success unreachable (V drops to 0 there). Uniform credit gives the
         6 work tokens (high entropy under the near-uniform policy; their true credit is what V
         says, about 0 while the policy does not read its own working) the sequence's advantage
         too, and blames the right answer bits of a failed response as much as the wrong one.
         16 questions. (The first carry, ``s0 c1 s1 c2`` with every bit graded, did not separate
         oracle credit from GRPO: nothing in it was free; see docs/benchmark.md.)
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
and 50% (keytok ~1/8, carry ~1/8, fork ~1/3); a task may warm-start it on noisy demonstrations
(:func:`demonstration`, ``bench_policy.WARM_STEPS``), none does at present.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from .datasource import Example
from ..engine.exactvalue import ResponseSpace

__all__ = ["CONTROLLED", "ControlledTask", "build", "demonstration", "solution", "fork_reward", "carry_reward"]

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
    """a + b written out LSB first, per column c_i x_i y_i s_i (carry in, digits, sum bit), then c2."""
    c, s = 0, []
    for i in range(2):
        x, y = (a >> i) & 1, (b >> i) & 1
        s += [str(c), str(x), str(y), str(x ^ y ^ c)]
        c = (x + y + c) >> 1
    return "".join(s + [str(c)])


#: carry's graded positions (0-based): the answer bits s0, s1, c2 (letters 4, 8, 9); the rest is work
CARRY_ANSWER = (3, 7, 8)


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
        ControlledTask("carry", ResponseSpace("01", 9), "2-bit binary addition written out column by column (carry in, "
                       "digits, sum bit; then the last carry); the answer bits decide, the work is not graded (16 questions)",
                       _carry_questions, warm=(0.5, 0.5)),
        ControlledTask("fork", ResponseSpace(FORK_ALPHABET, FORK_LENGTH), "forking token: the first of 6 letters over "
                       "{a, b, c} (the prompt's first letter) decides the outcome, the 5 after it are free (9 questions)",
                       _fork_questions, warm=(1 / 3, 1 / 3)),
    )
}


def solution(example: Example) -> str:
    """The one correct response of a controlled task's example."""
    return str(example.answer)


def keytok_reward(completion: str, example: Example) -> float:
    """1.0 iff the key positions hold the key's letters (the free positions are not read)."""
    c, want = completion.strip(), str(example.answer)
    return 1.0 if len(c) == len(want) and all(c[p] == want[p] for p in KEY_POSITIONS) else 0.0


def carry_reward(completion: str, example: Example) -> float:
    """1.0 iff the response has the task's length and its answer bits (CARRY_ANSWER: s0, s1, c2)
    are the sum's (the work around them is not read)."""
    c, want = completion.strip(), str(example.answer)
    return 1.0 if len(c) == len(want) and all(c[p] == want[p] for p in CARRY_ANSWER) else 0.0


def fork_reward(completion: str, example: Example) -> float:
    """1.0 iff the response has the task's length and its first letter (the fork) is the answer's
    (the letters after it are not read)."""
    c, want = completion.strip(), str(example.answer)
    return 1.0 if len(c) == len(want) and c[:1] == want[:1] else 0.0


REWARDS: Dict[str, Callable[[str, Example], float]] = {"keytok": keytok_reward, "carry": carry_reward, "fork": fork_reward}


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
    """A demonstration for the warm start: the task's length in letters uniform at random (every
    task's policy starts from the near-uniform one; none is warm-started at present)."""
    a = CONTROLLED[name].space.alphabet
    return "".join(rng.choice(a) for _ in str(example.answer))
