"""Hardware: published facts of known devices (facts) and what this machine has (detect).

Leaf knowledge that the plan, the runtime and design read; it imports nothing of the stages."""
