//! The HTTP client serve reaches its engines with: hyper's pooled HTTP/1 client over plain
//! TCP, with no proxy from the environment and no redirects followed (an engine's answer is
//! passed back as it is), `TCP_NODELAY`, a connect timeout, and TCP keepalive with a user
//! timeout, so that an engine whose host vanished without a reset (a power loss, a partition)
//! breaks its streams and pooled connections within about 30 to 60 seconds rather than never.
//!
//! hyper's client directly rather than through reqwest: the request path builds one
//! `Request` from a URI parsed when the engine joined, where reqwest parses its URL again,
//! builds its own request and wraps the answer's body per request. Serve's CPU per request fell
//! by a ninth with it (`benches/RESULTS.md`, "the engines' client on hyper").

use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, HeaderValue, Method, Request, Response, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// Idle time before TCP keepalive probes, and between them; unacknowledged data fails the
/// connection after twice this.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// An engine's answer, its body still to read.
pub(crate) type Answer = Response<Incoming>;

/// Why an engine's request failed before or while its answer came.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// The request could not be sent, or its answer's head not read.
    #[error("{}", with_causes(.0))]
    Send(#[from] hyper_util::client::legacy::Error),
    /// The answer's body broke off.
    #[error("the answer broke off: {}", with_causes(.0))]
    Body(#[from] hyper::Error),
}

/// `error` and its causes on one line, outermost first ("client error (Connect): tcp connect
/// error: Connection refused"): hyper's and reqwest's own text says only which step failed.
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

impl UpstreamError {
    /// Whether no connection could be made: nothing listens there (the engine is down).
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Send(e) if e.is_connect())
    }
}

/// The engines' client: cheap to clone (one pool behind).
#[derive(Clone, Debug)]
pub(crate) struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Upstream {
    /// A client that keeps up to `idle_per_engine` idle connections to each engine and gives
    /// up connecting after `connect_timeout`.
    pub(crate) fn new(connect_timeout: Duration, idle_per_engine: usize) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_keepalive(Some(KEEPALIVE));
        connector.set_keepalive_interval(Some(KEEPALIVE));
        connector.set_keepalive_retries(Some(3));
        connector.set_tcp_user_timeout(Some(2 * KEEPALIVE));
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(idle_per_engine)
            // Idle connections are closed in the background, not only when next taken.
            .pool_timer(TokioTimer::new())
            .build(connector);
        Upstream { client }
    }

    /// POSTs a JSON `body` to `uri` with `headers` besides its content type.
    pub(crate) async fn post_json(
        &self,
        uri: &Uri,
        headers: impl IntoIterator<Item = (header::HeaderName, HeaderValue)>,
        body: Bytes,
    ) -> Result<Answer, UpstreamError> {
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = uri.clone();
        let fields = request.headers_mut();
        fields.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        fields.extend(headers);
        Ok(self.client.request(request).await?)
    }

    /// GETs `uri`.
    pub(crate) async fn get(&self, uri: Uri) -> Result<Answer, UpstreamError> {
        let mut request = Request::new(Full::default());
        *request.uri_mut() = uri;
        Ok(self.client.request(request).await?)
    }
}

/// The answer's next chunk of data (`None` at its end), past any trailers.
pub(crate) async fn next_chunk(body: &mut Incoming) -> Result<Option<Bytes>, UpstreamError> {
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            return Ok(Some(data));
        }
    }
    Ok(None)
}

/// The answer's whole body.
pub(crate) async fn read_all(body: Incoming) -> Result<Bytes, UpstreamError> {
    Ok(body.collect().await?.to_bytes())
}

/// Whether an engine's answer is a server-sent event stream.
pub(crate) fn is_event_stream<B>(response: &Response<B>) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// `base` (an engine's `http://host:port`, any path prefix kept) with `path` after it: refused
/// unless it is plain HTTP with a host, a port that is a number when one is given, and no user
/// information (serve sends an engine's key as a bearer token, `api_key`).
pub(crate) fn engine_uri(base: &str, path: &str) -> Result<Uri, String> {
    let text = format!("{}{path}", base.trim_end_matches('/'));
    let uri: Uri = text.parse().map_err(|e| format!("url {base:?}: {e}"))?;
    let refuse = |why: &str| Err(format!("url {base:?}: {why}"));
    let Some(authority) = uri.authority().map(|a| a.as_str()) else {
        return refuse("serve reaches engines over plain http://host:port");
    };
    if uri.scheme_str() != Some("http") {
        return refuse("serve reaches engines over plain http://host:port");
    }
    if authority.contains('@') {
        return refuse("user information in a worker's url is not sent; use api_key");
    }
    // The host ends at an IPv6 literal's bracket, or else at the port's colon.
    let host_end = match authority.strip_prefix('[') {
        Some(rest) => rest.find(']').map_or(authority.len(), |i| i + 2),
        None => authority.find(':').unwrap_or(authority.len()),
    };
    if host_end == 0 {
        return refuse("no host");
    }
    match &authority[host_end..] {
        "" => {}
        port => {
            let number = port.strip_prefix(':').and_then(|p| p.parse::<u16>().ok());
            if !matches!(number, Some(1..)) {
                return refuse("the port is not a number from 1 to 65535");
            }
        }
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_is_written_with_each_of_its_causes() {
        #[derive(Debug, thiserror::Error)]
        #[error("client error (Connect)")]
        struct Outer(#[source] std::io::Error);
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(
            with_causes(&Outer(refused)),
            "client error (Connect): refused"
        );
        assert_eq!(
            with_causes(&std::fmt::Error),
            "an error occurred when formatting an argument"
        );
    }

    #[test]
    fn engine_uris_keep_the_base_path_and_refuse_what_plain_http_cannot_reach() {
        let uri = engine_uri("http://10.0.0.7:8000/", "/v1/completions").unwrap();
        assert_eq!(uri.to_string(), "http://10.0.0.7:8000/v1/completions");
        let uri = engine_uri("http://gpu-3:8000/engine-a", "/health").unwrap();
        assert_eq!(uri.path(), "/engine-a/health");
        for bad in [
            "https://gpu-3:8000",
            "gpu-3:8000",
            "http://",
            "http://a b:80",
        ] {
            assert!(engine_uri(bad, "/health").is_err(), "{bad}");
        }
    }
}
