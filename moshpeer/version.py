__version__ = "0.1.0"
# Peers refuse records and data-plane messages from a different protocol generation.
PROTOCOL_VERSION = 5  # 5: records carry run owners' credentials and revocation lists; 4: 4: records name the trainers they witnessed; 3: frames' MAC is AES-256-GCM
