"""Stubs generated from protos/inference.proto by `python -m serving.gen_protos`; do not edit.

POOL is a private descriptor pool: tritonclient registers the same message names in
protobuf's default pool, and both must load in one process (see serving/gen_protos.py)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
