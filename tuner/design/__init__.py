"""`tuner design`: the paper's co-design search. params (exact parameter counts) ->
candidates (shapes near the target, by the paper's rules) -> measure (their GEMMs on the
device, tuner.plan.probe) -> rank (throughput, speedup intervals, explanations) -> report."""
