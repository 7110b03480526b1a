"""Past one machine: replicas on Ray Serve (serve_ray.py), the ingress's prefix keys
(serve_requests.py) and the router that keeps each prefix on the replica that cached it
(serve_router.py). docs/scale.md."""
