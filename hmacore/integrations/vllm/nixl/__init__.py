"""HmaNixlConnector: P/D disaggregation over NIXL, pull (``scheduler``/``worker``) or
layer-wise push (``push_scheduler``/``push_worker``), one worker per TP rank (``_tp``);
``metadata``/``push_metadata`` are the scheduler -> worker payloads; ``connector`` is the
class vLLM loads."""
