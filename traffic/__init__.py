"""What crosses the fabric: packet layers, transports, collectives (to come)."""
