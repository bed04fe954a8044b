"""gateway: the OpenAI-compatible front of pdserve, in rooms (lowest first; a room imports only itself and
the rooms before it: tests/test_layering.py ROOMS):

  config, keyfile, models   the gateway's settings, the admin key file, the served models and their text bundles
  routing/                  which node serves a request: discovery, registry, router, activator, relay, node client
  admission/                how many run and wait (admission control) and what the autoscaler sees (traffic)
  api/                      what the API speaks: request/response models, OpenAPI, tools, formats, logprobs, stops
  service                   the gateway's state: served models, registry, admission, relay; one request's generation
  routes/                   the HTTP surface, an APIRouter per surface: openai (+ responses, tokens), health, admin,
                            internal; auth middleware and OpenAI-shaped errors
  app, main                 the FastAPI app that puts the routers together, and `pdserve gateway`
  status, chat              the CLI's `pdserve status` and `pdserve chat`
"""
