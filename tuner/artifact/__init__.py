"""The artifact folder: records (the manifest dataclasses), codec (JSON in both
directions), store (atomic writes and checked paths inside OUT), report (markdown + HTML)."""
