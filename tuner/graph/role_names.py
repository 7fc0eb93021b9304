"""The roles a graph input can play (tuner/graph/roles.py finds them from the structure)."""

# Roles of a graph input, found from the graph's structure (`input_specs`); names only break ties.
TOKEN_IDS, ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS, KV_CACHE, INPUTS_EMBEDS, OTHER = (
    "token_ids", "attention_mask", "position_ids", "token_type_ids", "kv_cache",
    "inputs_embeds", "other")
# An encoder-decoder's decoder (tuner/graph/encoder_side.py): what it takes from its encoder,
# along the encoder's length: its output, its mask, and (with past) the cross keys/values.
ENCODER_STATES, ENCODER_MASK, ENCODER_CACHE = "encoder_states", "encoder_mask", "encoder_cache"
ENCODER_ROLES = (ENCODER_STATES, ENCODER_MASK, ENCODER_CACHE)
# An image transformer's pixels (tuner/graph/pixels.py): (batch, channels, height, width)
PIXEL_VALUES = "pixel_values"
ROLES = (TOKEN_IDS, ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS, KV_CACHE, INPUTS_EMBEDS,
         *ENCODER_ROLES, PIXEL_VALUES, OTHER)
# Roles one input at most may hold: two claimants are a refusal (role_overrides.checked).
SINGULAR = (TOKEN_IDS, ATTENTION_MASK, POSITION_IDS, ENCODER_STATES, ENCODER_MASK,
            PIXEL_VALUES)
