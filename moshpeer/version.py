__version__ = "0.1.0"
# Peers refuse records and data-plane messages from a different protocol generation.
PROTOCOL_VERSION = 2
