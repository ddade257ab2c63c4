// The JDK's own HTTP client against the router's OpenAI front, as LangChain4j and Spring's
// RestClient use it: HttpClient.newHttpClient() speaks HTTP/2 by default, so on an http://
// URL every new connection's first request proposes an upgrade to h2c. Run as a single-file
// program: java OpenAiJdkClient.java BASE_URL MODEL
// Prints one line per request: "<http version> <status> <body, newlines escaped>".

import java.io.ByteArrayInputStream;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.util.stream.Collectors;

public class OpenAiJdkClient {
    public static void main(String[] args) throws Exception {
        String base = args[0];
        String model = args[1];
        HttpClient client = HttpClient.newHttpClient();
        String whole = body(model, "Name a colour.", false);
        String stream = body(model, "Name a fruit.", true);
        // A body of known length (Content-Length), twice on one client: the second request reuses
        // the connection the first one proposed h2c on.
        print(client.send(post(base, HttpRequest.BodyPublishers.ofString(whole)), HttpResponse.BodyHandlers.ofString()));
        print(client.send(post(base, HttpRequest.BodyPublishers.ofString(whole)), HttpResponse.BodyHandlers.ofString()));
        // A body streamed with no length (Transfer-Encoding: chunked), as Spring's RestClient sends one.
        byte[] bytes = stream.getBytes(StandardCharsets.UTF_8);
        HttpRequest chunked = post(base, HttpRequest.BodyPublishers.ofInputStream(() -> new ByteArrayInputStream(bytes)));
        HttpResponse<java.util.stream.Stream<String>> lines = client.send(chunked, HttpResponse.BodyHandlers.ofLines());
        String events = lines.body().collect(Collectors.joining("\\n"));
        System.out.println(lines.version() + " " + lines.statusCode() + " " + events);
    }

    static String body(String model, String question, boolean stream) {
        return "{\"model\":\"" + model + "\",\"messages\":[{\"role\":\"user\",\"content\":\"" + question
            + "\"}],\"max_tokens\":8,\"temperature\":0,\"stream\":" + stream + "}";
    }

    static HttpRequest post(String base, HttpRequest.BodyPublisher publisher) {
        return HttpRequest.newBuilder(URI.create(base + "/chat/completions"))
            .header("Content-Type", "application/json")
            .header("Authorization", "Bearer " + System.getenv("OPENAI_API_KEY"))
            .POST(publisher)
            .build();
    }

    static void print(HttpResponse<String> response) {
        System.out.println(response.version() + " " + response.statusCode() + " " + response.body().replace("\n", "\\n"));
    }
}
