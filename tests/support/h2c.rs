//! A real HTTP/2 client for the edge tests: cleartext HTTP/2 with prior
//! knowledge (Envoy's connection manager detects the preface with its
//! default `codec_type: AUTO`), built on the `h2` crate, optionally ending
//! the request with trailers instead of END_STREAM on the last DATA frame.

use crate::support::Reply;
use bytes::Bytes;

/// POSTs `body` to `path` over one fresh h2c connection; with `trailers`
/// the stream ends with a trailers frame (`x-client-trailer: done`).
pub fn post(port: u16, path: &str, body: &[u8], trailers: bool) -> Reply {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let (client, connection) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let mut client = client.ready().await.unwrap();
        let request = http::Request::builder()
            .method("POST")
            .uri(format!("http://127.0.0.1:{port}{path}"))
            .header("content-type", "application/json")
            .body(())
            .unwrap();
        let (response, mut stream) = client.send_request(request, false).unwrap();
        stream
            .send_data(Bytes::copy_from_slice(body), !trailers)
            .unwrap();
        if trailers {
            let mut t = http::HeaderMap::new();
            t.insert("x-client-trailer", http::HeaderValue::from_static("done"));
            stream.send_trailers(t).unwrap();
        }
        let (parts, mut recv) = response.await.unwrap().into_parts();
        let mut data = Vec::new();
        while let Some(chunk) = recv.data().await {
            let chunk = chunk.unwrap();
            let _ = recv.flow_control().release_capacity(chunk.len());
            data.extend_from_slice(&chunk);
        }
        Reply {
            status: parts.status.as_u16(),
            headers: parts
                .headers
                .iter()
                .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
                .collect(),
            body: String::from_utf8_lossy(&data).into_owned(),
        }
    })
}
