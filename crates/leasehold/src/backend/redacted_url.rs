//! A Redis URL fit for an error message: its password replaced by `***`.
//!
//! Errors end up in logs and on terminals; a URL that failed to parse is exactly the one a user
//! copies into a bug report.

/// `url` with the password of its user-info (`user:password@`) and any `pass=` / `password=`
/// query value (the form `redis+unix://` URLs use) replaced by `***`. Everything else is kept, so
/// the message still shows what is wrong with the URL.
///
/// The user-info runs to the *last* `@`: a URL that failed to parse may hold a password with an
/// unencoded `/`, `?` or `#`, and cutting at those first would show it. An `@` later in the URL
/// (rare in a Redis URL) hides a little more than the password; never less. Without `://` (a
/// mistyped scheme: `redis//:pw@host`, `redis:/:pw@host`, or none) nothing tells the user-info
/// from the scheme, so everything before the last `@` is hidden.
pub(crate) fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return match url.rsplit_once('@') {
            Some((_, host)) => redacted_query(&format!("***@{host}")),
            None => redacted_query(url),
        };
    };
    let rest = match rest.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{host}"),
            None => rest.to_owned(),
        },
        None => rest.to_owned(),
    };
    redacted_query(&format!("{scheme}://{rest}"))
}

/// `url` with any `pass=` / `password=` query value replaced by `***`.
fn redacted_query(url: &str) -> String {
    let Some((head, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, _)) if key == "pass" || key == "password" => format!("{key}=***"),
            _ => pair.to_string(),
        })
        .collect();
    format!("{head}?{}", pairs.join("&"))
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_are_hidden_and_the_rest_is_kept() {
        let cases = [
            (
                "redis://admin:s3cret@127.0.0.1:6379/x",
                "redis://admin:***@127.0.0.1:6379/x",
            ),
            ("rediss://:s3cret@host/0", "rediss://:***@host/0"),
            ("redis://a:b:c@d@host", "redis://a:***@host"),
            ("redis://user@host:1/", "redis://user@host:1/"),
            ("redis://127.0.0.1:6379/", "redis://127.0.0.1:6379/"),
            (
                "redis+unix:///tmp/r.sock?db=1&pass=s3cret",
                "redis+unix:///tmp/r.sock?db=1&pass=***",
            ),
            ("not a url", "not a url"),
            // A mistyped scheme: the URL does not parse, and is shown.
            ("redis//:s3cret@127.0.0.1:1/", "***@127.0.0.1:1/"),
            ("redis:/:s3cret@127.0.0.1:1/", "***@127.0.0.1:1/"),
            ("s3cret@127.0.0.1:1", "***@127.0.0.1:1"),
            // Unencoded `/`, `?` or `#` in a password: the URL does not parse, and is shown.
            (
                "redis://u:pa/s3cret@127.0.0.1:16392/",
                "redis://u:***@127.0.0.1:16392/",
            ),
            (
                "redis://:pa?s3cret@127.0.0.1:16392/",
                "redis://:***@127.0.0.1:16392/",
            ),
            ("redis://:s3#cret@host/0", "redis://:***@host/0"),
            (
                "redis://host/0?password=s3cret@x",
                "redis://host/0?password=***",
            ),
        ];
        for (url, shown) in cases {
            assert_eq!(redacted(url), shown, "{url}");
            assert!(!redacted(url).contains("s3cret"));
        }
    }
}
