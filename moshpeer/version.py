__version__ = "0.1.0"
# Peers refuse records and data-plane messages from a different protocol generation. 8: kept connections are rebound
# to the next all-reduce (handshake.rebind); 7: records say since which epoch a trainer back from an outage trained
# apart; 6: group id and order follow group_order.py; 5: records carry run owners' credentials and revocation lists;
# 4: records name the trainers they witnessed; 3: frames' MAC is AES-256-GCM.
PROTOCOL_VERSION = 8
