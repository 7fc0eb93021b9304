"""Hardware: published facts of known devices (facts), what this machine has (detect) and what
its cgroup lets this process use (cgroup: a container's memory and CPU limits).

Leaf knowledge that the plan, the runtime and design read; it imports nothing of the stages."""
