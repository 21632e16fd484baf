//! The demo's web server on 127.0.0.1: the embedded page, the control endpoints and the live
//! event stream (server-sent events).

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::broadcast::error::RecvError;

use super::controller::{Controller, Refusal};
use super::params::Params;

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const STYLE_CSS: &str = include_str!("assets/style.css");

/// Binds 127.0.0.1:`port`, or a free port if that one is taken.
pub async fn bind(port: u16) -> std::io::Result<TcpListener> {
    match TcpListener::bind((Ipv4Addr::LOCALHOST, port)).await {
        Ok(listener) => Ok(listener),
        Err(e) if port != 0 && e.kind() == std::io::ErrorKind::AddrInUse => {
            say!("leasehold demo: port {port} is taken; using a free port instead");
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await
        }
        Err(e) => Err(e),
    }
}

/// The page's address on `addr`.
pub fn url(addr: SocketAddr) -> String {
    format!("http://{addr}/")
}

/// The routes of the demo, around `controller`.
pub fn router(controller: Arc<Controller>) -> Router {
    Router::new()
        .route("/", get(|| asset("text/html; charset=utf-8", INDEX_HTML)))
        .route("/app.js", get(|| asset("text/javascript", APP_JS)))
        .route("/style.css", get(|| asset("text/css", STYLE_CSS)))
        .route("/events", get(events))
        .route("/api/start", post(start))
        .route("/api/pause", post(pause))
        .route("/api/reset", post(reset))
        .with_state(controller)
}

async fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    // Embedded in the binary, so a page can never be stale against its server.
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
}

type Reply = Result<Json<Value>, (StatusCode, String)>;

fn reply(result: Result<Value, Refusal>) -> Reply {
    result.map(Json).map_err(|refusal| match refusal {
        Refusal::Invalid(e) => (StatusCode::BAD_REQUEST, e),
        Refusal::Store(e) => (StatusCode::SERVICE_UNAVAILABLE, e),
    })
}

async fn start(State(c): State<Arc<Controller>>, Json(params): Json<Params>) -> Reply {
    reply(c.start(params).await)
}

async fn pause(State(c): State<Arc<Controller>>) -> Json<Value> {
    Json(c.pause().await)
}

async fn reset(State(c): State<Arc<Controller>>, Json(params): Json<Params>) -> Reply {
    reply(c.reset(params).await)
}

async fn events(
    State(c): State<Arc<Controller>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    Sse::new(stream_of(c)).keep_alive(KeepAlive::default())
}

/// What one page receives: a hello (the state and recent frames), then every message as it is
/// sent.
pub fn stream_of(c: Arc<Controller>) -> impl Stream<Item = Result<Event, Infallible>> {
    let (hello, receiver) = c.subscribe();
    let first = stream::once(async move { Ok(Event::default().event("hello").data(hello)) });
    let rest = stream::unfold((c, receiver), |(c, mut receiver)| async move {
        match receiver.recv().await {
            Ok((name, data)) => {
                let event = Event::default().event(name).data(&*data);
                Some((Ok(event), (c, receiver)))
            }
            // A page too slow to keep up missed messages, maybe a state change (a reset) as
            // well as frames: it starts over from a fresh hello, as a page that just opened.
            Err(RecvError::Lagged(_)) => {
                let (hello, receiver) = c.subscribe();
                let event = Event::default().event("hello").data(hello);
                Some((Ok(event), (c, receiver)))
            }
            Err(RecvError::Closed) => None,
        }
    });
    first.chain(rest)
}
