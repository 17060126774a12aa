"""Names ported scripts import from Accelerate's ``utils``: helpers, availability checks, and the ones nbaccel refuses."""
