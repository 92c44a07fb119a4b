"""The names memaudit's Flower messages use, importable without JAX or Flower: the record and
field that carry the payload (`memaudit.federated.flower.wire` packs it) and the message types of
memaudit's ClientApp (`memaudit.flower_node`)."""

RECORD, FIELD = "memaudit", "payload"
HELLO, STAGE, SECAGG = "memaudit_hello", "memaudit_stage", "memaudit_secagg"
