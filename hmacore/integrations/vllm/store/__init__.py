"""HmaStoreConnector: KV offload and cross-instance prefix reuse through a hash-addressed store
(``backend``: the embedded store or Mooncake); ``scheduler`` (lookups, save bookkeeping),
``worker`` (store I/O), ``metadata`` (payloads), ``connector`` (the class vLLM loads)."""
