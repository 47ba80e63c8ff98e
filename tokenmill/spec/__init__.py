"""Speculative decoding: proposers (ngram, draft_model, layer_skip, medusa, eagle), adaptive k,
counters, and the exactness check. Verification itself is tokenmill.sample.rejection."""
