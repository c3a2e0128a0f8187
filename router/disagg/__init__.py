"""Prefill/decode disaggregation (vLLM 0.34's NixlConnector in pull mode), the gateway's side.

    roles      which replicas prefill and which decode (the configuration's lists)
    planner    decode first: the decode replica, whether to split, the prefill replica
    decision   whether a request is worth a prefill leg at all (the thresholds)
    legs       the prefill leg's body from the client's, the decode leg's from the prefill
               answer; what a prefill answer carries, per API
    collect    the transport of a prefill leg: its answer read whole, never relayed
    handover   one request's prefill answer to its decode leg, and what each leg teaches
    watch      what P/D tells the operator: per-role metrics, misconfiguration warnings

The flow itself is the exchange's (a plan of a ``prefill`` leg then a ``decode`` leg): the
request path plans decode first, the exchange sends the legs in order and re-plans, prefill
included, when one fails before its first byte.
"""
