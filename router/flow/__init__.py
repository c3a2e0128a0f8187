"""Flow control: fair queuing per tenant while the fleet is saturated (docs/flow-control.md).

``fairqueue`` (the order), ``saturation`` (when to hold back), ``ratelimit`` (per-minute
limits), ``sessions`` (which flow inside a tenant), ``controller`` (admission, release, shedding:
the asyncio glue), ``settings`` (a tenant's and the controller's), ``request`` (what it reads of
a request), ``ticket`` (a released request's slot), ``metrics``,
``shared`` (per-tenant usage across gateways through Redis). Nothing is imported here, so
``router.tenancy.table`` can read ``router.flow.settings`` without pulling in the rest.
"""
