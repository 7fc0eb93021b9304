"""The accuracy gate: one entry (entry.prepare: feeds, reference, tolerances, cache policy),
feeds built for the model (feeds, kv_feeds), the greedy rollouts of a cache model (kv_gate)
and the one comparison every variant must pass before it is written, selected or served
(verify). It fails closed."""
