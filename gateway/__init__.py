"""gateway: the OpenAI-compatible front of pdserve, in rooms (lowest first; a room imports only itself and
the rooms before it: tests/test_layering.py ROOMS):

  config, keyfile, models   the gateway's settings, the admin key file, the served models and their text bundles
  routing/                  which node serves a request: discovery, registry, router, activator, relay, node client
  admission/                how many run and wait (admission control) and what the autoscaler sees (traffic)
  api/                      the HTTP surface: request/response models, OpenAI routes, tools, formats, admin, internal
  service, app, main        the gateway's state, its FastAPI app, and `pdserve gateway`
  status, chat              the CLI's `pdserve status` and `pdserve chat`
"""
