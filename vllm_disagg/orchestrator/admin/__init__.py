"""The operators' HTTP surfaces: the admin API and its OpenAPI description, their authentication, and
the dashboard."""
