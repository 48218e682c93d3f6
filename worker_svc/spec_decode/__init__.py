"""Speculative decoding on the worker: proposers of draft tokens (ngram on the host; an EAGLE-3 head
or a draft model on the device), the exact verification of drafts by sampling at every drafted
position, and the bookkeeping that settles each step's accepted tokens into the persistent batch."""
