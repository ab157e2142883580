"""Drafters: what proposes tokens for the target to verify.

    drafter = ModelDrafter(draft_model)                                   # a small stand-alone model
    drafter = ModelDrafter(target, exit_layer=6, shares_target_cache=True)  # truncate:6
    drafter = NgramDrafter(max_ngram=3)                                     # prompt lookup
    drafter = LookupFirst(eagle3_drafter)               # prompt lookup where it matches, the model elsewhere
    drafter = LookupFirst(eagle3_drafter, table=PhraseTable.load(path))  # ... the target's phrases before the model
    drafter.start(prompt, capacity)
    draft = drafter.draft(ids, gamma=4, sampler=sampler)   # Draft(tokens [g], probs [g, V] | None)

(`specdec_runtime.drafters.spec.build_drafter("truncate:6", target)` builds any drafter from its
command-line spec.) The protocol is `start` and `draft`. `start` is called once per prompt, after
the target's prefill. `draft` receives the whole sequence so far, ids [L]: the target has verified
ids[:L-1] into its KV cache and ids[L-1] is the newest token; it returns up to gamma tokens that
should follow (or a token tree at most gamma deep; LookupFirst's lookups up to max(gamma,
tokens)). A drafter that reads the target's hidden states (Medusa, MTP heads, EAGLE-3) names the
layers in `hidden_layers` and receives, through `observe`, after every target forward, the
residual streams after those layers at the positions the loop accepted, in order, the last one
being the position that produced the newest token (after the prefill: every prompt position).
"""

from specdec_runtime.drafters.protocol import Draft, Drafter, empty_draft

__all__ = ["Draft", "Drafter", "empty_draft"]
