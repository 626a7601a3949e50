"""How the fabric is routed: controller apps (os-ken) and the pure route computation."""
