"""On-policy RL (GRPO) on top of the shared precision flow: trainer-side pure functions.

``logprobs.py`` computes the trainer's per-token logprobs of given completions (one full
forward in the *train* precision phase), the reference every rollout logprob is compared with.
"""
