"""Memory planning of the BAGEL engine: what a request needs, counted from its shape alone (no forward runs).

Token and byte accounting (:mod:`.accounting`), the device-memory plan of a run (:mod:`.plan`, its KV terms
:mod:`.plan_kv`, the runtime and VAE terms :mod:`.runtime`, :mod:`.vae`), ComfyUI's placement of it
(:mod:`.comfy_placement`) and the search for the most images a card holds (:mod:`.card_fit`, :mod:`.image_fit`).
It imports the run path's settings and configs, never the command line (import-linter contract
``engine-in-three-packages``).
"""
