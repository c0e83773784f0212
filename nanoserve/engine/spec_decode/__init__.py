"""Speculative decoding (docs/speculative.md): proposers that guess k tokens ahead, and the scheduler's books
for the 1 + k tokens a request then computes in one step. Verification is layers/rejection_sampler.py."""
