"""The scheduler's bulk append (``Scheduler.extend``, the engine's host sync per decode window) is the
per-token ``append`` loop, result for result: tokens kept, finish reason, stop reason, freed slots."""

import random

from jetrl.engine.sampling import SamplingParams
from jetrl.engine.scheduler import Scheduler, Sequence, StopChecker


def _run(bulk: bool, seed: int):
    rng = random.Random(seed)
    max_tokens, max_len = rng.randint(1, 12), rng.randint(6, 30)
    stop_ids = set(rng.sample(range(8), rng.randint(0, 2)))
    check = StopChecker(SamplingParams(max_tokens=max_tokens, ignore_eos=True), stop_ids, max_len)
    scheduler = Scheduler(4)
    seqs = [Sequence([1] * rng.randint(1, 5), i, 0, i) for i in range(4)]
    for seq in seqs:
        scheduler.add_group([seq])
    scheduler.admit()
    for _ in range(4):  # windows of random length over the sequences still running
        steps = rng.randint(1, 5)
        for seq in list(scheduler.running.values()):
            tokens = [rng.randrange(40) for _ in range(steps)]
            logprobs = [-rng.random() for _ in range(steps)]
            if bulk:
                scheduler.extend(seq, tokens, logprobs, check)
            else:
                for token, logprob in zip(tokens, logprobs):
                    if scheduler.append(seq, token, logprob, check):
                        break
    return [(s.output_ids, s.output_logprobs, s.finish_reason, s.stop_reason, s.slot) for s in seqs], scheduler._free


def test_extend_is_the_append_loop():
    for seed in range(300):
        assert _run(True, seed) == _run(False, seed), seed
