"""Admission and flow control: the gateway's queue of requests that should not reach an engine yet
(docs/admission.md). ``policy`` orders, shares and sheds; ``fit`` says whether a request's pair has
room; ``classify`` reads a request's priority and tenant. All pure: the gateway and the cluster
simulator drive the same code."""
