"""Speculative decoding's drafting: the proposer interface, its two proposers (prompt lookup, a
draft model), the scheduler's plan of which rows draft, and the one call site that drafts."""
