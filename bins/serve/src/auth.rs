//! Who may call what: one layer in front of every route.
//!
//! | routes | who |
//! |---|---|
//! | `/health`, `/ready` | anyone |
//! | `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `POST /v1/route` (query only) | the client key or the admin key |
//! | `/v1/workers` (list, add, remove), `DELETE /v1/route/{id}`, `POST /v1/route` with `"book": true` | the admin key |
//! | `/metrics` | anyone with `public_metrics`, else the admin key |
//!
//! A route is open when its key is not configured: with neither key every route is open (a
//! router on a trusted network); with only the client key, the admin routes answer 403 (no
//! client key opens them). No key: 401; a client key on an admin route: 403. Keys are compared
//! in constant time and never forwarded.

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::Response;

use super::proxy::error;
use super::AppState;

/// What a route needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Liveness and readiness: no key.
    Public,
    /// Routing: the client key (or the admin key).
    Client,
    /// The fleet and bookings: the admin key.
    Admin,
    /// `/metrics`: public when configured so, else admin.
    Metrics,
}

/// The key a request showed, as the layer found it: handlers that need more than their
/// route's access (a booking through `/v1/route`) read it from the request's extensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Granted {
    /// The admin key, or no key is configured at all.
    Admin,
    /// The client key (or no client key is configured).
    Client,
}

/// The access a route needs, by its method and path.
pub(crate) fn access(method: &Method, path: &str) -> Access {
    match path {
        "/health" | "/ready" => Access::Public,
        "/metrics" => Access::Metrics,
        "/v1/route" if method == Method::POST => Access::Client,
        p if p.starts_with("/v1/workers") || p.starts_with("/v1/route") => Access::Admin,
        _ => Access::Client,
    }
}

/// Whether `given` equals `key`, in time that depends on their lengths only.
pub(crate) fn constant_time_eq(given: &[u8], key: &[u8]) -> bool {
    let mut diff = given.len() ^ key.len();
    for (i, k) in key.iter().enumerate() {
        let g = given.get(i).copied().unwrap_or(!k);
        diff |= usize::from(g ^ k);
    }
    diff == 0
}

fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    headers
        .get(header::AUTHORIZATION)?
        .as_bytes()
        .strip_prefix(b"Bearer ")
}

/// The keys a service checks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Keys<'a> {
    pub client: Option<&'a str>,
    pub admin: Option<&'a str>,
    pub public_metrics: bool,
}

impl Keys<'_> {
    /// Whether a request with `headers` may call a route that needs `access`: what it was
    /// granted, or 401 (no valid key) or 403 (the client key on an admin route).
    pub(crate) fn check(&self, access: Access, headers: &HeaderMap) -> Result<Granted, StatusCode> {
        let needs_admin = match access {
            Access::Public => return Ok(Granted::Client),
            Access::Metrics if self.public_metrics => return Ok(Granted::Client),
            Access::Client => false,
            Access::Admin | Access::Metrics => true,
        };
        let given = bearer(headers);
        let shows = |key: Option<&str>| {
            key.zip(given)
                .is_some_and(|(k, g)| constant_time_eq(g, k.as_bytes()))
        };
        let open = self.admin.is_none() && self.client.is_none();
        if open || shows(self.admin) {
            return Ok(Granted::Admin);
        }
        let client = shows(self.client);
        if !needs_admin && (client || self.client.is_none()) {
            return Ok(Granted::Client);
        }
        if needs_admin && client {
            return Err(StatusCode::FORBIDDEN);
        }
        Err(StatusCode::UNAUTHORIZED)
    }
}

/// Checks a request's key against its route: what it was granted, or the status that
/// refuses it (401 or 403; [`refuse`] makes the answer).
pub(crate) fn admit(state: &AppState, request: &Request) -> Result<Granted, StatusCode> {
    let needs = access(request.method(), request.uri().path());
    state.keys().check(needs, request.headers())
}

/// A 401 or a 403, in OpenAI's shape, counted under the route `auth`.
pub(crate) fn refuse(state: &AppState, status: StatusCode) -> Response {
    let message = if status == StatusCode::FORBIDDEN {
        "this route needs the admin key"
    } else {
        "invalid API key"
    };
    error(state, "auth", status, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_equal_only_when_equal() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secreT", b"secret"));
        assert!(!constant_time_eq(b"secret!", b"secret"));
        assert!(!constant_time_eq(b"secre", b"secret"));
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn routes_are_classed_by_method_and_path() {
        assert_eq!(access(&Method::GET, "/health"), Access::Public);
        assert_eq!(access(&Method::GET, "/ready"), Access::Public);
        assert_eq!(access(&Method::GET, "/metrics"), Access::Metrics);
        assert_eq!(access(&Method::POST, "/v1/route"), Access::Client);
        assert_eq!(access(&Method::DELETE, "/v1/route/3"), Access::Admin);
        assert_eq!(access(&Method::GET, "/v1/workers"), Access::Admin);
        assert_eq!(access(&Method::DELETE, "/v1/workers/1"), Access::Admin);
        assert_eq!(access(&Method::POST, "/v1/completions"), Access::Client);
        assert_eq!(access(&Method::GET, "/v1/models"), Access::Client);
        assert_eq!(access(&Method::GET, "/anything/else"), Access::Client);
    }

    fn with_key(key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {key}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn each_key_opens_its_routes_and_no_more() {
        let both = Keys {
            client: Some("c"),
            admin: Some("a"),
            public_metrics: false,
        };
        let (none, client, admin, wrong) = (
            HeaderMap::new(),
            with_key("c"),
            with_key("a"),
            with_key("x"),
        );
        use Access::*;
        assert_eq!(both.check(Public, &none), Ok(Granted::Client));
        assert_eq!(both.check(Client, &none), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(both.check(Client, &wrong), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(both.check(Client, &client), Ok(Granted::Client));
        assert_eq!(both.check(Client, &admin), Ok(Granted::Admin));
        assert_eq!(both.check(Admin, &none), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(both.check(Admin, &wrong), Err(StatusCode::UNAUTHORIZED));
        assert_eq!(both.check(Admin, &client), Err(StatusCode::FORBIDDEN));
        assert_eq!(both.check(Admin, &admin), Ok(Granted::Admin));
        assert_eq!(both.check(Metrics, &client), Err(StatusCode::FORBIDDEN));
        assert_eq!(both.check(Metrics, &admin), Ok(Granted::Admin));
        let public = Keys {
            public_metrics: true,
            ..both
        };
        assert_eq!(public.check(Metrics, &none), Ok(Granted::Client));

        // Only a client key: the admin routes are closed to every key.
        let client_only = Keys {
            client: Some("c"),
            admin: None,
            public_metrics: false,
        };
        assert_eq!(client_only.check(Client, &client), Ok(Granted::Client));
        assert_eq!(
            client_only.check(Admin, &client),
            Err(StatusCode::FORBIDDEN)
        );
        assert_eq!(
            client_only.check(Admin, &none),
            Err(StatusCode::UNAUTHORIZED)
        );

        // Only an admin key: routing is open, the fleet is not.
        let admin_only = Keys {
            client: None,
            admin: Some("a"),
            public_metrics: false,
        };
        assert_eq!(admin_only.check(Client, &none), Ok(Granted::Client));
        assert_eq!(
            admin_only.check(Admin, &none),
            Err(StatusCode::UNAUTHORIZED)
        );
        assert_eq!(
            admin_only.check(Admin, &wrong),
            Err(StatusCode::UNAUTHORIZED)
        );
        assert_eq!(admin_only.check(Admin, &admin), Ok(Granted::Admin));

        // No key at all: everything is open.
        let open = Keys {
            client: None,
            admin: None,
            public_metrics: false,
        };
        assert_eq!(open.check(Admin, &none), Ok(Granted::Admin));
        assert_eq!(open.check(Metrics, &none), Ok(Granted::Admin));
    }
}
