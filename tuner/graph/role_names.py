"""The roles a graph input can play (tuner/graph/roles.py finds them from the structure)."""

# Roles of a graph input, found from the graph's structure (`input_specs`); names only break ties.
TOKEN_IDS, ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS, KV_CACHE, INPUTS_EMBEDS, OTHER = (
    "token_ids", "attention_mask", "position_ids", "token_type_ids", "kv_cache",
    "inputs_embeds", "other")
ROLES = (TOKEN_IDS, ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS, KV_CACHE, INPUTS_EMBEDS, OTHER)
# Roles one input at most may hold: two claimants are a refusal (role_overrides.checked).
SINGULAR = (TOKEN_IDS, ATTENTION_MASK, POSITION_IDS)
